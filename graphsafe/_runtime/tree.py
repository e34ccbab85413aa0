"""Around a binding: which derivations a class has, where a path leads, what was swapped.

The binder asks for a class's derivations before `bind` and for swapped submodules after
it; the runtime asks for the tensor a `refresh(changed=...)` path names.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from graphsafe._declare.decorators import class_registries
from graphsafe._declare.registry import Registry
from graphsafe._declare.spec import Derivation
from graphsafe._errors import GraphSafetyError, RegistrationError
from graphsafe._runtime.binding import Binding

__all__ = ["derivations_for", "swapped_modules", "tensor_at"]


def swapped_modules(binding: Binding) -> list[str]:
    """Paths, in tree order, of submodules replaced (or removed) since `binding` was made."""
    mods = binding.modules
    if not mods:
        return []
    parents, keys, children, _ = zip(*mods)
    try:
        # One flat pass: every parent's `_modules` entry, compared by identity (a list
        # compares its items by identity first, and modules define no `__eq__`).
        now = list(map(dict.get, map(_MODULES, map(_CALL, parents)), keys))
    except AttributeError:  # a parent is gone: find which, one by one
        now = None
    if now is not None and now == list(map(_CALL, children)):
        return []
    return [
        path
        for parent, key, child, path in mods
        if _child(parent(), key) is not child()
    ]


_MODULES = operator.attrgetter("_modules")
_CALL = weakref.ref.__call__


def _child(parent: nn.Module | None, key: str) -> nn.Module | None:
    return parent._modules.get(key) if parent is not None else None


def derivations_for(consulted: Sequence[Registry], cls: type) -> list[Derivation]:
    """The derivations of `cls`, without repeats, from `consulted` (the runtime's registries)
    and the registries its classes name; `RegistrationError` if two declare one output."""
    registries = list(consulted)
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


def tensor_at(model: nn.Module, path: str) -> torch.Tensor:
    """The tensor (parameter, buffer or attribute) at the dotted `path` from `model`, e.g.
    `layers.0.weight`; `GraphSafetyError` if nothing, or no tensor, is there."""
    obj: Any = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
    if not isinstance(obj, torch.Tensor):
        raise GraphSafetyError(
            f"refresh(changed=...) names {path!r}, which is not a tensor of the model",
            module_class=type(model).__name__,
            path=path,
            expected="dotted paths from the model root, e.g. 'layers.0.weight'",
            got=repr(path),
            fix="use names from model.named_parameters() / named_buffers()",
        )
    return obj
