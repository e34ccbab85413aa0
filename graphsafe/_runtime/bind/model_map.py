"""Every storage of one model, walked once and walked again only when the model changed.

Every tracked load watches every storage of its model, so that what it writes reaches
the journal whoever else reads it. Walking a model of thousands of tensors costs more
than tracking a load of them, so the binder keeps the walk's `ModelMap` and asks it,
before each load, whether it still holds (`ModelMap.holds`): a flat check of what could
change it, compiled where the compiled checks are built (`model_map.cpp`: `same_tree`
over the modules, `same_refs` over the objects on the way; on any change the Python
pass answers, so both paths agree). It sees a tensor rebound or moved
where the walk found one (`.to()`, `share_memory_()`, `p.data = w`, a view at another
stride, a new parameter object), any entry added to, removed from or replaced in a
module's parameters, buffers, submodules or attributes, and an object on the way to
tensors (a list, a kernel object, a closure) replaced, grown or shrunk. It cannot see a
tensor put into an object that held none when it was walked (the watch of the
derivations' own inputs and buffers, taken by the engine, never depends on it). While it
holds, loads share its set of storage keys (`key_set`), and an engine whose rebinding
check reads what it recorded (`rows`) skips that check as a load begins. Another model's
recording asks only whether the modules' dicts and tables hold (`tables_hold`): the
weights depend on nothing else.
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from graphsafe import _native
from graphsafe._memory.snapshot import PLAIN, Identities
from graphsafe._memory.walk import (
    Attr,
    Cell,
    Field,
    Reach,
    Ref,
    Site,
    Slot,
    step,
    storage_key,
    walk,
    walk_modules,
)

__all__ = ["ModelMap", "ModelStorages"]

_MODULE_INTERNALS = frozenset(vars(nn.Module()))
_TABLES = ("_parameters", "_buffers", "_modules")
_DICT = operator.attrgetter("__dict__")
_CALL = weakref.ref.__call__


class ModelMap:
    """One walk of a model: where each storage is, which tensors are its weights, and
    the flat record that tells whether the walk still describes the model.

    Args:
        model: The root module.
    """

    __slots__ = (
        "_holders",
        "_identities",
        "_ids",
        "_lens",
        "_looked",
        "_modules",
        "_names",
        "_native",
        "_nested",
        "_refs",
        "_table_ids",
        "_tables",
        "by_path",
        "foreign",
        "key_set",
        "keys",
        "table_keys",
        "weight_keys",
        "weights",
    )

    def __init__(self, model: nn.Module, reach: Reach | None = None) -> None:
        reach = walk(model) if reach is None else reach  # `reach`: a walk of it just made
        modules = reach.modules if reach.modules is not None else list(
            dict.fromkeys(s.module for s in walk_modules(model)))
        at = {id(m): i for i, m in enumerate(modules)}
        tables_at, self._tables, tables, self._holders, self._names, self._ids, lens = (
            _map_modules(modules))
        keys, by_path, weights, owned, direct, nested = _map_sites(reach.sites, tables_at, at)
        self.keys: dict[int, str] = keys
        """Storage key -> the first path holding it (every storage with bytes)."""
        self.by_path: dict[str, int] = by_path
        """Dotted path of every tensor -> its storage key (0: no bytes)."""
        self.weights: tuple[str, ...] = tuple(weights)
        """Paths of the model's weights: parameters and persistent buffers (what a
        checkpoint holds), those on the meta device included (released transient
        inputs), zero-size ones left out."""
        self.weight_keys = frozenset(map(by_path.__getitem__, weights)) - {0}
        """Storage keys of the weights."""
        self.table_keys = frozenset(owned) - {0}
        """Storage keys of every parameter and buffer (the weights, and buffers no
        checkpoint holds)."""
        self.key_set = frozenset(self.keys)
        """The storage keys of `keys`, as one set kept with the walk: every load watches
        it (the compiled tracker reads a set it was given before once)."""
        self._identities = Identities(direct, len(direct))
        self._nested = nested
        # The modules, their dicts and tables are read through weak references each time:
        # a record that held them would keep a dropped model (and its runtime) alive.
        self._modules = [weakref.ref(m) for m in modules]
        self._table_ids = list(map(id, tables))
        self._refs, sizes = _map_refs(reach.refs, tables_at, at)
        self._lens = lens + sizes
        self._native = _native.get()
        # What the compiled pass remembers of each module dict and table it passed (its
        # version tag): one that kept its tag is not looked into again.
        self._looked = bytearray(24 * (len(self._modules) + len(self._table_ids)))
        self.foreign: Any = None
        """The model's weights as another model's recording reads them (`Binder.foreign`),
        made when first asked for and kept with the walk (while it holds, no parameter or
        buffer was added, removed, rebound or moved)."""

    def holds(self) -> bool:
        """Whether the model still has exactly the tensors and storages walked."""
        return self._check(refs=True)

    def tables_hold(self) -> bool:
        """Whether the module tree, its modules' own dicts and their tables still hold what
        was walked (every module, attribute, parameter and buffer, each tensor of a table
        unmoved), what the attributes hold below them left unread: what the model's
        weights are depends on nothing else (`Binder.foreign`)."""
        return self._check(refs=False)

    def _check(self, *, refs: bool) -> bool:
        native = self._native
        if native is not None:  # the pass over the modules compiled: one call
            n = len(self._modules) + len(self._table_ids)
            try:
                same = (
                    native.same_tree(self._modules, *self._tables, self._table_ids,
                                     self._holders, self._names, self._ids, self._lens[:n],
                                     self._looked)
                    and self._identities.unchanged()
                    and (not refs or not (self._refs or self._nested) or native.same_refs(
                        self._modules, self._refs, self._lens[n:], self._nested, _STEPS))
                )
            except (KeyError, IndexError, TypeError, AttributeError, ValueError):
                same = False
            finally:
                self._identities.take_read()
            if same:
                return True
            # Something changed, or could not be read: the Python pass answers.
        return self._holds(refs=refs)

    def _off_modules_hold(self, ref_sizes: list[int]) -> bool:
        """The objects on the way to tensors, and the tensors held through them, as walked
        (`ref_sizes`: what the walk found each of those objects to hold).

        Each object is read in one step from the object that held it when walked, read
        just before and found to be that one still (or from its module's dict), so that
        every object is read once, whatever its depth."""
        if not self._refs and not self._nested:
            return True
        dicts: dict[int, dict[str, Any]] = {}
        now: list[Any] = []  # what each ref's place holds now, in the order of `_refs`
        for (i, key, chain, obj, via), size in zip(self._refs, ref_sizes, strict=True):
            value = step(now[via], chain[-1]) if via >= 0 else _resolve(
                _module_dict(dicts, self._modules, i), key, chain)
            if id(value) != obj or _size(value) != size:
                return False
            now.append(value)
        for i, key, chain, obj, ptr, via in self._nested:
            t = step(now[via], chain[-1]) if via >= 0 else _resolve(
                _module_dict(dicts, self._modules, i), key, chain)
            if id(t) != obj or not isinstance(t, torch.Tensor) or _data_ptr(t) != ptr:
                return False
        return True

    def _holds(self, *, refs: bool = True) -> bool:
        # Flat passes (maps of C calls): this runs before every load.
        modules = list(map(_CALL, self._modules))
        if None in modules:  # a module was dropped
            return False
        try:
            dicts = list(map(_DICT, modules))
            tables = self._tables_of(dicts)
            n = len(dicts) + len(tables)
            return (
                list(map(id, tables)) == self._table_ids
                and _ids_at([*dicts, *tables], self._holders, self._names) == self._ids
                and [*map(len, dicts), *map(len, tables)] == self._lens[:n]
                and self._identities.unchanged()
                and (not refs or self._off_modules_hold(self._lens[n:]))
            )
        except (KeyError, IndexError, TypeError, AttributeError, ValueError):
            return False
        finally:
            self._identities.take_read()  # what it read: kept by nothing

    def _tables_of(self, dicts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The parameter, buffer and submodule tables of the modules whose dicts are
        `dicts`."""
        index, names = self._tables
        return list(map(dict.__getitem__, map(dicts.__getitem__, index), names))

    @property
    def rows(self) -> Identities:
        """What the walk found in the parameter and buffer tables (identity, pointer,
        stride): its check holding proves a watch recorded the same unmoved."""
        return self._identities

    def paths_of(self, keys: Iterable[int]) -> list[str]:
        """Every path whose storage is among `keys`."""
        wanted = set(keys)
        return [p for p, k in self.by_path.items() if k and k in wanted]


_Row = tuple[int, int | None, tuple[int, ...] | None]
_STEPS = (Attr, Slot, Field, Cell)
"""The walk's steps, as the compiled check of the objects on the way reads them
(`same_refs`: `step` compiled)."""
_TENSOR = operator.attrgetter("tensor")
_OBJ = operator.attrgetter("obj")
_SIZED = frozenset({list, tuple, dict})
_UNTYPED = torch.Tensor.untyped_storage
_NBYTES = torch.UntypedStorage.nbytes
_STORAGE_PTR = torch.UntypedStorage.data_ptr
_DATA_PTR = torch.Tensor.data_ptr
_STRIDE = torch.Tensor.stride


_Direct = tuple[Any, Any, object, int, tuple[int, ...]]
_Nested = tuple[int, Any, tuple[Any, ...], int, int, int]
_Way = tuple[int, Any, tuple[Any, ...], int, int]


def _map_modules(modules: list[nn.Module]) -> tuple[
        dict[int, str], tuple[list[int], list[str]], list[dict[str, Any]], list[int],
        list[Any], list[int], list[int]]:
    """`ModelMap`'s pass over the modules' own dicts: the id of each parameter and buffer
    table -> its name (`_tables_by_id`); where each module's parameter, buffer and
    submodule tables are, and the tables; every entry the tables' rows do not read
    (attributes, submodules, parameter or buffer slots holding None), by holder (a dict's
    index, a table's index after them), key and the id of what it holds; and the size of
    each dict and table. One compiled call where the compiled checks are built and every
    dict is a dict (`map_modules`, held to this loop by a property test)."""
    native = _native.get()
    if native is not None:
        found = native.map_modules(modules, _MODULE_INTERNALS)
        if found is not None:
            return found
    dicts = list(map(_DICT, modules))
    tables_at = _tables_by_id(modules)
    slots = [(i, name) for i, d in enumerate(dicts) for name in _TABLES if name in d]
    index, names = [i for i, _ in slots], [name for _, name in slots]
    tables = list(map(dict.__getitem__, map(dicts.__getitem__, index), names))
    entries = [(i, k) for i, d in enumerate(dicts) for k in d if k not in _MODULE_INTERNALS]
    entries += [(len(dicts) + j, k) for j, t in enumerate(tables) for k, v in t.items()
                if not isinstance(v, torch.Tensor)]
    holders = [h for h, _ in entries]
    keys = [k for _, k in entries]
    return (tables_at, (index, names), tables, holders, keys,
            _ids_at([*dicts, *tables], holders, keys), [*map(len, dicts), *map(len, tables)])


def _map_refs(refs: list[Ref], tables_at: dict[int, str],
              at: dict[int, int]) -> tuple[list[_Way], list[int]]:
    """`ModelMap`'s pass over a walk's objects on the way to tensors: where each is, by
    id (nothing the model drops is kept alive by this record), read in one step from the
    object on the way that holds it (`via`, read before it: the walk lists parents
    first) or from its module's dict; and how many things each holds, read from the walk
    just made (it is what its path leads to now). One compiled call where the compiled
    checks are built (`map_refs`, held to this loop by a property test)."""
    native = _native.get()
    if native is not None:
        return native.map_refs(refs, tables_at, at,
                               functools.partial(_from_dict, tables=tables_at))
    return ([(at[id(r.module)], r.key, r.chain, id(r.obj), r.via)
             if id(r.container) not in tables_at
             else (at[id(r.module)], *_from_dict(r, tables_at), id(r.obj), r.via)
             for r in refs],
            [len(o) if type(o) in _SIZED else _size(o) for o in map(_OBJ, refs)])


def _map_sites(sites: list[Site], tables_at: dict[int, str], at: dict[int, int]) -> tuple[
        dict[int, str], dict[str, int], list[str], set[int], list[_Direct], list[_Nested]]:
    """`ModelMap`'s pass over a walk's sites: the first path of each storage key, the key
    of each path, the weights' paths, the keys of every parameter and buffer, the rows
    of what the modules' tables hold (`Identities`), and where each tensor held elsewhere
    is reached from its module (`tables_at`: `_tables_by_id`; `at`: each module's index).
    One compiled call where the compiled checks are built and every tensor is a plain
    one (`map_sites`, held to this loop by a property test)."""
    native = _native.get()
    if native is not None:
        found = native.map_sites(sites, tables_at, at,
                                 functools.partial(_from_dict, tables=tables_at))
        if found is not None:
            return found
    keys: dict[int, str] = {}
    by_path: dict[str, int] = {}
    weights: list[str] = []
    owned: set[int] = set()
    direct: list[_Direct] = []
    nested: list[_Nested] = []
    read = _read_all(sites)
    with PLAIN():  # metadata reads: no subclass __torch_function__ (vLLM's)
        for site, (key, ptr, stride) in zip(sites, read or map(_read_one, sites),
                                            strict=True):
            path, module, container, name, chain, t, _ = site
            by_path[path] = key
            if key and key not in keys:
                keys[key] = path
            if chain:  # held through an object on the way: no table of a module
                if ptr is not None:
                    table = tables_at.get(id(container))
                    if table is None:  # most: what an attribute holds
                        nested.append((at[id(module)], name, chain, id(t), ptr, site.via))
                    else:
                        nested.append((at[id(module)], *_from_dict(site, tables_at),
                                       id(t), ptr, site.via))
                continue
            # A weight: a parameter, or a buffer not marked non-persistent.
            table = tables_at.get(id(container))
            if table is not None and container is _DICT(module).get(table):
                owned.add(key)
                if ((table == "_parameters"
                     or name not in module._non_persistent_buffers_set)
                        and (t.numel() or t.device.type == "meta")):
                    weights.append(path)
            if ptr is None:
                continue  # no storage to move (sparse, a wrapper subclass)
            if table is None or stride is None:
                nested.append((at[id(module)], *_from_dict(site, tables_at), id(t), ptr,
                               site.via))
            else:  # a module's parameters or buffers: tables that hold no module
                direct.append((container, name, t, ptr, stride))
    return keys, by_path, weights, owned, direct, nested


def _read_all(sites: list[Site]) -> list[_Row] | None:
    """`(storage key, data pointer, strides)` of each site's tensor, read in flat passes
    (maps of C calls: a walk of thousands of tensors); None when one of them cannot be
    read so (a wrapper subclass, a sparse tensor): `_read_one` reads each apart. (Where
    the compiled checks are built, `map_sites` read what a compiled call can.)"""
    tensors = list(map(_TENSOR, sites))
    try:
        with PLAIN():
            storages = list(map(_UNTYPED, tensors))
            keys = [ptr if size else 0 for ptr, size in
                    zip(map(_STORAGE_PTR, storages), map(_NBYTES, storages))]
            ptrs: list[int | None] = list(map(_DATA_PTR, tensors))
            strides: list[tuple[int, ...] | None] = list(map(_STRIDE, tensors))
    except (RuntimeError, NotImplementedError):
        return None
    return list(zip(keys, ptrs, strides))


def _read_one(site: Site) -> _Row:
    """`_read_all`'s row of one site, each read apart, as it can be made."""
    t = site.tensor
    return storage_key(t), _data_ptr(t), _stride(t)


def _tables_by_id(modules: Iterable[nn.Module]) -> dict[int, str]:
    """The id of each module's parameter and buffer table -> the table's name."""
    out: dict[int, str] = {}
    for m in modules:
        d = _DICT(m)
        for table in ("_parameters", "_buffers"):
            if table in d:
                out[id(d[table])] = table
    return out


def _from_dict(site: Site | Ref, tables: dict[int, str]) -> tuple[Any, tuple[Any, ...]]:
    """The key and chain of `site` from its module's `__dict__`: what a parameter holds
    (`lin.weight.packed`) is reached through the module's `_parameters` table (`tables`:
    `_tables_by_id` of the modules)."""
    table = tables.get(id(site.container))
    if table is not None and site.container is _DICT(site.module).get(table):
        return table, (site.key, *site.chain)
    return site.key, site.chain


def _data_ptr(t: torch.Tensor) -> int | None:
    try:
        return int(t.data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


def _stride(t: torch.Tensor) -> tuple[int, ...] | None:
    try:
        return tuple(t.stride())
    except (RuntimeError, NotImplementedError):
        return None


def _ids_at(holders: list[dict[str, Any]], index: list[int], keys: list[Any]) -> list[int]:
    """The id of what `holders[index[i]]` holds under `keys[i]`, for each i."""
    return list(map(id, map(dict.get, map(holders.__getitem__, index), keys)))


def _resolve(holder: Any, key: Any, chain: tuple[Any, ...]) -> Any:
    value = holder[key]
    for k in chain:
        value = step(value, k)
    return value


def _size(obj: Any) -> int:
    """How many things `obj` holds (a list grown, an attribute added)."""
    if isinstance(obj, (list, tuple, dict)):
        return len(obj)
    d = getattr(obj, "__dict__", None)
    return len(d) if type(d) is dict else 0


def _module_dict(dicts: dict[int, dict[str, Any]], modules: list[weakref.ref[nn.Module]],
                 i: int) -> dict[str, Any]:
    """The `__dict__` of module `i` (read once per check, kept in `dicts`); AttributeError
    if the module is gone."""
    found = dicts.get(i)
    if found is None:
        found = dicts[i] = _DICT(modules[i]())
    return found


class ModelStorages(Mapping[int, str]):
    """`{storage key: first path}` of every storage of a model, walked when a key is
    first looked up, not before.

    A first materialization asks for the model's storages to refuse what its function
    reads or writes undeclared; a function that reads only its inputs and what its own
    ops made (`ReadGuard.fresh`) asks for none, and the model is not walked for it.
    Buffers noted before the walk (`setdefault`: what a materialization registered) are
    kept beside what it finds.

    Args:
        walk: Walks the model now and returns the mapping (`storage_paths`).

    Examples:
        >>> from graphsafe._memory.walk import storage_paths
        >>> m = nn.Linear(2, 2)
        >>> found = ModelStorages(lambda: storage_paths(m))
        >>> found.walked, storage_key(m.weight) in found, found.walked
        (False, True, True)
    """

    __slots__ = ("_found", "_noted", "_walk")

    def __init__(self, walk: Callable[[], dict[int, str]]) -> None:
        self._walk = walk
        self._found: dict[int, str] | None = None
        self._noted: dict[int, str] = {}

    @property
    def walked(self) -> bool:
        """Whether a lookup has walked the model."""
        return self._found is not None

    def _all(self) -> dict[int, str]:
        found = self._found
        if found is None:
            found = self._found = self._walk()
            for key, path in self._noted.items():
                found.setdefault(key, path)
            self._noted = {}
        return found

    def __getitem__(self, key: int) -> str:
        return self._all()[key]

    def __contains__(self, key: object) -> bool:
        return key in self._all()

    def __iter__(self) -> Iterator[int]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    def setdefault(self, key: int, path: str) -> str:
        """Note `path` for `key` unless a path is known for it (without walking)."""
        found = self._noted if self._found is None else self._found
        return found.setdefault(key, path)
