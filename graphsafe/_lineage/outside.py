"""Tensors a graph reads that no model holds, and numbers kept outside the model,
computed from a model's weights.

A kernel library may keep what it derives from a weight in a process-wide cache keyed by
the weight's `data_ptr()` and shape, or a registry keyed by the layer's name: the model
holds nothing of it, so the walk never finds it, yet a captured graph reads it. A capture
lists the tensors it read that the model does not hold (`Guard.inputs`); those the
bring-up's recording saw computed from the weights are found here (`find_outside`) and
guarded like what the model holds. Each is named by the cache that holds it, found once
at the capture among what modules keep (`mylib._PACKED[(94..., (6, 4))]`), or, where no
module keeps it, as a tensor outside the model.

A number the recorded load took from the weights (`.item()`) that the model does not
keep may be kept by a module the same way (a registry of per-layer scales, a class
attribute): found by identity, when the load ends, among what the modules whose code took
numbers keep (`find_outside_values`), and guarded like the numbers the model keeps.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from graphsafe._lineage.record.recorder import Lineage, ambiguous, sid_of
from graphsafe._lineage.resolve import Found, Source, find, trace
from graphsafe._memory.walk import Site, ValueSite

__all__ = ["OUTSIDE", "find_outside", "find_outside_values", "name_outside"]

OUTSIDE = "<outside the model>"
"""The prefix of the path of a tensor no model holds."""


def find_outside(
    lineage: Lineage, model: nn.Module, tensors: Sequence[torch.Tensor],
    sources: dict[int, Source],
) -> list[Found]:
    """The tensors of `tensors` (read by a capture, held by no model) that `lineage`
    saw computed from `sources`, each at a site of its own (`holder[0]`, a list only the
    entry holds: the graph reads the tensor, so it is kept), named where it is held."""
    alive = lineage.alive()
    wanted = [t for t in tensors if (sid := sid_of(t)) in alive and sid not in sources]
    if not wanted:
        return []
    names = name_outside(wanted)
    sites = [Site(f"{OUTSIDE} {names[id(t)]}", model, [t], 0, (), t) for t in wanted]
    return find(lineage, sites, sources, alive - sources.keys())


def find_outside_values(
    lineage: Lineage, model: nn.Module, sources: dict[int, Source], kept: Iterable[int],
) -> list[Found]:
    """The numbers `lineage` took from `sources` that the model does not keep (`kept`:
    the `id`s of those it does), found by identity where a module whose code took numbers
    (`Lineage.scopes`) keeps them: a global (`mylib.ALPHA`), an item of a global dict
    (`mylib._SCALES['layers.0']`), an attribute of a class it defines. Floats and the ints
    Python makes anew only: a `bool` or a small `int` is one object everywhere."""
    taken = set(kept)
    wanted: dict[int, tuple[object, Found]] = {}
    for vid, made in lineage.values.items():
        call, value = made[-1]
        if vid in taken or type(value) not in (int, float) or ambiguous(value):
            continue
        srcs, chain, opaque = trace(call, sources)
        if srcs:
            site = ValueSite("", model, None, None, (), value)
            wanted[vid] = value, Found(site, srcs, chain, opaque, (call, None))
    if not wanted:
        return []
    out = []
    for space in list(lineage.scopes.values()):  # the modules whose code took numbers
        for where, container, key, value in _places(space):
            number, f = wanted.get(id(value), (None, None))
            if f is not None and number is value:
                site = ValueSite(f"{OUTSIDE} {where}", model, container, key, (), value)
                out.append(f._replace(site=site))
                del wanted[id(value)]
                if not wanted:
                    return out
    return out


def _places(space: dict[str, Any]) -> Iterable[tuple[str, Any, Any, Any]]:
    """(name, container, key, value) of each global of a module (`space`: its globals),
    each item of a dict it keeps as a global, and each attribute of a class it defines."""
    prefix = str(space.get("__name__", "?"))
    for name, value in list(space.items()):
        yield f"{prefix}.{name}", space, name, value
        if issubclass(type(value), dict):  # type(): a lazy module attribute is not read
            for key, item in _items(value):
                yield f"{prefix}.{name}[{key!r}]", value, key, item
        elif issubclass(type(value), type) and vars(value).get("__module__") == prefix:
            for attr, inner in list(vars(value).items()):
                yield f"{prefix}.{name}.{attr}", vars(value), attr, inner


def name_outside(tensors: Iterable[torch.Tensor]) -> dict[int, str]:
    """`id` of each tensor -> where a module keeps its storage: `module.NAME[key]` (a
    dict the module keeps as a global, or as an attribute of a class it defines),
    `module.NAME` (a global tensor), or `a tensor at 0x...` when none does. Matched by
    storage: a capture reads an alias of what the cache holds."""
    tensors = list(tensors)
    by_sid = {sid_of(t): id(t) for t in tensors}
    names = {id(t): f"a tensor at 0x{t.data_ptr():x}" for t in tensors}
    left = set(by_sid)
    for module in list(sys.modules.values()):
        if not left:
            break
        for where, value in _globals(module):
            for key, held in _items(value):
                if issubclass(type(held), torch.Tensor) and (sid := sid_of(held)) in left:
                    names[by_sid[sid]] = where if key is None else f"{where}[{key!r}]"
                    left.discard(sid)
    return names


def _globals(module: Any) -> Iterable[tuple[str, Any]]:
    """(`module.NAME`, value) for each global of `module`, and for each attribute of a
    class it defines (`module.Class.NAME`)."""
    space = getattr(module, "__dict__", None)
    if not isinstance(space, dict):
        return
    prefix = getattr(module, "__name__", "?")
    for name, value in list(space.items()):
        yield f"{prefix}.{name}", value
        if issubclass(type(value), type) and vars(value).get("__module__") == prefix:
            for attr, inner in list(vars(value).items()):
                yield f"{prefix}.{name}.{attr}", inner


def _items(value: Any) -> Iterable[tuple[Any, Any]]:
    """(key, item) of a dict, or (None, value) for anything else (by `type`: `isinstance`
    reads `__class__`, which a deprecated or lazy module attribute answers with a
    warning or an import)."""
    if issubclass(type(value), dict):  # type(): a lazy module attribute is not read
        try:
            # dict's own items: a subclass's `items` may import what it maps (transformers'
            # lazy auto mappings) and raise; what it stores is what a cache keeps.
            yield from list(dict.items(value))
        except RuntimeError:  # changed size while read (another thread)
            return
    else:
        yield None, value
