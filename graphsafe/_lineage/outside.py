"""Tensors a graph reads that no model holds, computed from a model's weights.

A kernel library may keep what it derives from a weight in a process-wide cache keyed by
the weight's `data_ptr()` and shape, or a registry keyed by the layer's name: the model
holds nothing of it, so the walk never finds it, yet a captured graph reads it. A capture
lists the tensors it read that the model does not hold (`Guard.inputs`); those the
bring-up's recording saw computed from the weights are found here (`find_outside`) and
guarded like what the model holds. Each is named by the cache that holds it, found once
at the capture among what modules keep (`mylib._PACKED[(94..., (6, 4))]`), or, where no
module keeps it, as a tensor outside the model.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from graphsafe._lineage.recorder import Lineage, sid_of
from graphsafe._lineage.resolve import Found, Source, find
from graphsafe._memory.walk import Site

__all__ = ["OUTSIDE", "find_outside", "name_outside"]

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
            yield from list(value.items())
        except RuntimeError:  # changed size while read (another thread)
            return
    else:
        yield None, value
