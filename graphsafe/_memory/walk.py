"""The one walk over a module tree: every submodule binding and every reachable tensor.

Everything in graphsafe that looks for tensors in a model walks it here, so that all agree
on what "every tensor" means (parameters, buffers, and plain attributes, through lists,
tuples and dicts at any depth). Each comes with its `Site`, so that a caller can read it
again, or put something else there, through the same container.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["ModuleSite", "Site", "storage_key", "storage_paths", "walk_modules", "walk_tensors"]

# The attributes every nn.Module has in its __dict__: registries and hook tables, never
# user tensors. `_parameters` and `_buffers` are walked on their own.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


class Site(NamedTuple):
    """Where one tensor lives: `container[key][chain[0]][chain[1]]...` is `tensor`.

    `container` is `module._parameters`, `module._buffers` or `module.__dict__`; `chain`
    (keys into nested lists, tuples and dicts) is empty for a tensor held directly; `path`
    is dotted from the root (`layers.0.cache.1` for an item of a list attribute).
    """

    path: str
    module: nn.Module
    container: Any
    key: Any
    chain: tuple[Any, ...]
    tensor: torch.Tensor


class ModuleSite(NamedTuple):
    """Where one module is bound: `parent._modules[key]` is `module`, at the dotted `path`
    (for the root: path and key `""`, parent None)."""

    path: str
    parent: nn.Module | None
    key: str
    module: nn.Module


def walk_modules(model: nn.Module) -> Iterator[ModuleSite]:
    """Yield the root, then every submodule binding, depth first in registration order.

    A module shared by several parents is yielded at each binding, so that replacing it at
    any of them can be seen; its own submodules are walked once, under its first path.
    `None` entries are skipped.

    Examples:
        >>> shared = nn.Linear(2, 2)
        >>> [s.path for s in walk_modules(nn.Sequential(shared, nn.ReLU(), shared))]
        ['', '0', '1', '2']
    """
    yield ModuleSite(path="", parent=None, key="", module=model)
    yield from _bindings(model, "", {id(model)})


def _bindings(module: nn.Module, head: str, seen: set[int]) -> Iterator[ModuleSite]:
    for key, child in tuple(module._modules.items()):
        if child is None:
            continue
        path = head + key
        yield ModuleSite(path=path, parent=module, key=key, module=child)
        if id(child) not in seen:
            seen.add(id(child))
            yield from _bindings(child, f"{path}.", seen)


def walk_tensors(model: nn.Module) -> Iterator[Site]:
    """Yield a `Site` for every place a tensor reachable from `model` is held.

    Per module, in `walk_modules` order: parameters, buffers, then plain attributes
    through lists, tuples and dicts (cycles end; `None` is skipped). A shared module is
    walked once; a tensor held in several places (tied weights) is yielded at each.

    Examples:
        >>> m = nn.Linear(2, 2)
        >>> m.cache = [torch.zeros(1), None, {"k": torch.ones(1)}]
        >>> [s.path for s in walk_tensors(m)]
        ['weight', 'bias', 'cache.0', 'cache.2.k']
    """
    seen: set[int] = set()
    for where in walk_modules(model):
        module = where.module
        if id(module) in seen:
            continue
        seen.add(id(module))
        head = f"{where.path}." if where.path else ""
        for container in (module._parameters, module._buffers):
            for name, value in tuple(container.items()):
                if isinstance(value, torch.Tensor):
                    yield Site(head + name, module, container, name, (), value)
        attrs = module.__dict__
        for name, value in tuple(attrs.items()):
            if name in _MODULE_INTERNALS:
                continue
            for chain, path, tensor in _held(value, (), head + name, set()):
                yield Site(path, module, attrs, name, chain, tensor)


def _held(
    value: object, chain: tuple[Any, ...], path: str, seen: set[int]
) -> Iterator[tuple[tuple[Any, ...], str, torch.Tensor]]:
    """Yield `(chain, path, tensor)` for every tensor in `value`, through containers."""
    if isinstance(value, torch.Tensor):
        yield chain, path, value
        return
    if isinstance(value, nn.Module) or id(value) in seen:
        return  # submodules are walked on their own; cycles end here
    items: tuple[tuple[Any, object], ...]
    if isinstance(value, (list, tuple)):
        items = tuple(enumerate(value))
    elif isinstance(value, dict):
        items = tuple(value.items())
    else:
        return
    seen.add(id(value))
    for key, item in items:
        yield from _held(item, (*chain, key), f"{path}.{key}", seen)
    seen.discard(id(value))


def storage_key(t: torch.Tensor) -> int:
    """`t.untyped_storage().data_ptr()`, or 0 when there are no bytes to tell apart.

    Zero-byte, meta and storage-less tensors (sparse, wrapper subclasses) all share key 0,
    so 0 must never be used to tell tensors apart or to track them.

    Examples:
        >>> storage_key(torch.empty(0)), storage_key(torch.eye(2).to_sparse())
        (0, 0)
        >>> x = torch.zeros(4)
        >>> storage_key(x[2:]) == storage_key(x) != 0
        True
    """
    try:
        storage = t.untyped_storage()
        return storage.data_ptr() if storage.nbytes() else 0
    except (RuntimeError, NotImplementedError):
        return 0


def storage_paths(model: nn.Module) -> dict[int, str]:
    """`{storage key: first path}` of every storage of `model` that has bytes."""
    found: dict[int, str] = {}
    for site in walk_tensors(model):
        key = storage_key(site.tensor)
        if key:
            found.setdefault(key, site.path)
    return found
