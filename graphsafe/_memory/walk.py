"""The one walk over a module tree: every submodule binding and every reachable tensor.

Everything in graphsafe that looks for tensors in a model walks it here, so that all of
them agree on what "every tensor" means: parameters, buffers, plain tensor attributes in
`module.__dict__`, and tensors held in lists, tuples and dicts stored as attributes, at
any depth. Each tensor comes with where it lives (`Site`), so a caller can read it again
through the same container, or put something else there.
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
    """Where one tensor lives: `container[key][chain[0]][chain[1]]...` is `tensor`."""

    path: str
    """Dotted path from the root (`layers.0.cache.1` for an item of a list attribute)."""

    module: nn.Module
    """The module that holds the tensor."""

    container: Any
    """The dict `key` indexes: `module._parameters`, `module._buffers` or
    `module.__dict__`."""

    key: Any
    """The key of the tensor, or of the outermost list, tuple or dict holding it, in
    `container`."""

    chain: tuple[Any, ...]
    """Further keys into nested lists, tuples and dicts; empty for a tensor held
    directly."""

    tensor: torch.Tensor
    """The tensor found there."""


class ModuleSite(NamedTuple):
    """Where one module is bound: `parent._modules[key]` is `module`."""

    path: str
    """Dotted path from the root; `""` for the root itself."""

    parent: nn.Module | None
    """The module that holds it; None for the root."""

    key: str
    """Its key in `parent._modules`; `""` for the root."""

    module: nn.Module
    """The module bound there."""


def walk_modules(model: nn.Module) -> Iterator[ModuleSite]:
    """Yield the root, then every binding of a submodule, depth first in registration order.

    A module shared by several parents is yielded once per binding, so that replacing it
    at any of them can be seen; its own submodules are walked once, under its first path.
    `None` entries of `_modules` are skipped.

    Args:
        model: The root module.

    Yields:
        One `ModuleSite` per binding, the root first (parent None, path `""`).

    Examples:
        >>> from torch import nn
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
    """Yield every tensor reachable from `model`'s module tree.

    For each module, in `walk_modules` order: its parameters, its buffers, then its plain
    attributes, following lists, tuples and dicts (cycles end). `None` entries are
    skipped. A module shared by several parents is walked once, under its first path; a
    tensor held in several places (tied weights) is yielded at each.

    Args:
        model: The root module.

    Yields:
        One `Site` per place a tensor is held.

    Examples:
        >>> import torch
        >>> from torch import nn
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
    """The address of `t`'s storage, or 0 when there are no bytes to tell apart.

    Tensors with storage of zero bytes, meta tensors and tensors without storage
    (sparse, wrapper subclasses) all get 0: they share it, so key 0 must never be used to
    tell tensors apart or to track them.

    Args:
        t: Any tensor.

    Returns:
        `t.untyped_storage().data_ptr()`, or 0 as above.

    Examples:
        >>> import torch
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
    """`{storage key: path}` of every tensor of `model`, the first path of each storage.

    Args:
        model: The root module.

    Returns:
        The map; zero-byte storages are left out.
    """
    found: dict[int, str] = {}
    for site in walk_tensors(model):
        key = storage_key(site.tensor)
        if key:
            found.setdefault(key, site.path)
    return found
